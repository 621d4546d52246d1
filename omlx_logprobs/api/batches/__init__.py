"""OpenAI's Batch API: `/v1/files` (upload.py) and `/v1/batches` (protocol.py), each line of a
batch's JSONL run through the same route handler as an interactive request (dispatch.py) at a
low priority, a bounded number at a time (worker.py); routes.py serves them, runner.py starts
and resumes them. What is on disk (files, batch records, each batch's results and journal) is
batchdir/'s."""
