"""rich renderables, one module per command: they show what the library computed and compute no
metric. Only the commands print them."""
