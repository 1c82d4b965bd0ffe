"""Running a case for real: worker processes, emulated devices and links, host probes, MPS, multi-node."""
