"""Helpers shared by the tests; the fixtures that use them stay in the conftest files.

Split by what they import: `engine`, `faults` and `scripted` need only MLX and the package (the GPU
host runs the engine tests without the HTTP stack); `server` needs httpx, psutil and uvicorn.
"""
