"""One module per command, each exposing its command function; vtoken_cli/app.py registers them.
A command parses options, builds a config, calls the library and prints what render/ returns.
No command module imports the app."""
