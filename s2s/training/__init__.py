"""Training the shipped echo model (`s2s train echo`)."""
