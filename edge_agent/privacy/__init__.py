"""Privacy on the device: the settings, the release mechanisms, the modes that run them
round by round, the accountant and the durable ledger."""
