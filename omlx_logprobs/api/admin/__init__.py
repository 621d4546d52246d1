"""The server's own routes, no API's: `/health`, the logprobs page at `/` and the OpenAPI
document with its Swagger UI at `/docs`."""
