"""Native kernels of the runtime (C sources built on first use with the system's C compiler)."""
