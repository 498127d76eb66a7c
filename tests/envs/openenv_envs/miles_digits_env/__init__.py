"""A small OpenEnv environment for the Miles tests (see ../README.md)."""
