"""Who holds what in a simulated fleet: partitions, the digits-5 and glyphs-5 data sets, backbone bundles."""
