"""From a config to rows: settings, config composition, case preparation, execution, rounds, sweeps."""
