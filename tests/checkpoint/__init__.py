"""Checkpoints (src/jaxstate/_checkpoint/): `state_dict` and `load_state_dict`,
`save` and `load` (`.npz`), Equinox's serialisation and Orbax."""
