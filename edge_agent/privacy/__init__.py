"""Privacy on the device: release mechanisms, the accountant and the durable ledger."""
