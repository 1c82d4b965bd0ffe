"""Studies of the harness itself: the paper's figures, calibration, the regression check, noise, dilation, planner checks."""
