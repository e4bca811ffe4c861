"""The nightly paper digest: sources -> model calls -> store -> rendered outputs."""
