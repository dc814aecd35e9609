"""What the tests and the benchmarks share: real processes and the ways to drive them.

- :mod:`.arbiter_process`: a node arbiter in its own process (``python -m jupyter_vgpu.node``);
- :mod:`.kernel_runner`: an IPython kernel started with jupyter_client, as a server starts one;
- :mod:`.server_process`: a single-user Jupyter server (or JupyterLab) on loopback;
- :mod:`.preloaded`: the environment of a process whose ``cudaMalloc`` is the pausable
  allocator's, and running code in one;
- :mod:`.lab_client`: a user's server driven over REST and the kernel websocket;
- :mod:`.documents`: valid documents of the contracts;
- :mod:`.waiting`: the one way to wait for a condition (:func:`.waiting.wait_for`; inside
  an event loop, :func:`.waiting.wait_for_async`).

Nothing of the package imports it; it needs the ``test`` extra (requests,
websocket-client, nbformat) and, for the server, the ``hub`` extra (its port picker).
"""
