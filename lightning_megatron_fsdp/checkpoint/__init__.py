"""The checkpoint protocol, one module per phase: errors, format, commit, storage, save, load."""
