"""The vtoken command-line tool."""
