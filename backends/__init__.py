"""One module per accelerator. Importing this package imports no device SDK."""
