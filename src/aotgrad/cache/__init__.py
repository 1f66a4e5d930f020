"""The on-disk cache of what the torch.compile backends compiled, for warm starts.

Takes a Dynamo graph, its example inputs and the backend's settings; returns a key (`key.py`) and,
on a hit, the rebuilt run (`load.py`: Inductor's code loaded by its FX-graph key, the stored `Plan`
to the run-time generator); on a miss it records what the compile produced (`serialize.py`).
`store.py` reads and writes the versioned, checksummed entries.
"""
