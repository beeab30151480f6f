"""Built-in nanocore plugins; each subpackage is registered through the `nanocore` entry-point group."""
