"""The worker tier of a sharded coordinator (docs/scale.md): the workers' intake, store
and partial sums, and the round owner that closes rounds over them."""
