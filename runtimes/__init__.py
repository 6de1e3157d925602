"""speedc.runtimes."""
