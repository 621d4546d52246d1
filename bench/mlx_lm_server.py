"""mlx-lm's own server (`mlx_lm.server`, unchanged), started after OpenBLAS is loaded the way our
server loads it. Without that, on a Linux CPU the mlx wheel's reference BLAS does mlx-lm's
matmuls (minutes for a 64-request wave of SmolLM2-135M) and the comparison measures BLAS, not
servers. On a GPU the preload changes nothing. The listen backlog is raised (see below).
Arguments are mlx_lm.server's.

    python -m bench.mlx_lm_server --model DIR --port 8080 --decode-concurrency 64

Run as a module from the repo root, as above: sys.path then starts with the root, not bench/, so
bench's modules named like common ones (server, report) are `bench.server` and `bench.report`
and stay out of mlx-lm's way with no path patch. (Run as a file, bench/ would come first and
shadow them.)
"""

# ruff: noqa: I001, E402  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

from omlx_logprobs import BLAS

print(f"BLAS: {BLAS}", flush=True)  # the line Server.blas_line() reads

from http.server import ThreadingHTTPServer

from mlx_lm.server import main

# socketserver's listen backlog is 5: with 32 or 64 clients connecting at once (mlx-lm answers
# in HTTP/1.0, so every request is a new connection) while its generation thread holds the GIL,
# the queue overflows and requests die with connection resets. A deeper backlog changes nothing
# else about the server.
ThreadingHTTPServer.request_queue_size = 256

if __name__ == "__main__":
    main()
