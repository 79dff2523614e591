"""Data-parallel replicas on Ray Serve behind one OpenAI endpoint, with a routing policy.

``policy`` is pure Python; ``replica``, ``router`` and ``app`` import ray and are loaded only by
``infer serve --data-parallel-size N`` (or ``serve run infer.cluster.app:build``), so a plain
``infer serve`` never imports ray. Ray is the optional ``ray`` extra.
"""

RAY_INSTALL_HINT = 'replicas need Ray Serve: pip install -e ".[ray]"'
