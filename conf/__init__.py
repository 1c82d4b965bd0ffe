"""hetbench's Hydra configs. Installed, this folder is the package `bench.conf` (pyproject.toml
maps it), which Hydra reads as `pkg://bench.conf`; it holds no code."""
