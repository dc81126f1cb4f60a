"""How a simulated fleet runs: the memory, mqtt and vector transports, their brokers, workers and run specs."""
