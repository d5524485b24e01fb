"""Leaves: small modules that import nothing of memtop above them.

`alloc_conf` (PYTORCH_CUDA_ALLOC_CONF as torch parses it), `jobs` (a process's job labels from
its scheduler or pod), `user_frame` (the user's line of a stack frame), `children` (child
processes that never outlive memtop and start isolated from the caller's directory), `untrusted`
(reading what another user may control: files, paths, names), `errors` (memtop's exceptions),
`records` (`record`: `dataclasses.dataclass` for memtop's frozen records, their methods not
compiled one by one), `choice` (the str enum every closed set of words is).

May import only the standard library and each other as the layers contract orders them
(`children` asks `untrusted`); everything else may import them, the agent inside a trainer too.
"""
