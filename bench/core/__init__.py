"""The domain core: interfaces with the plugins, clusters and device types, programs, shares, errors, paths."""
