"""The `nanocore` commands: argument parsing and printing over the library modules of the core.

The run path (`nanocore.trainer` and everything it imports) never imports this package; a command
module may import any library module, never the other way round.
"""
