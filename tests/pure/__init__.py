"""Pure functions and devices (src/jaxstate/_pure/): `to_pure` and `from_pure`,
`shard_map`, `device_put` and sharded state."""
