"""OpenAI's Batch API: `/v1/files` (files.py, upload.py) and `/v1/batches` (batches.py), each
line of a batch's JSONL run through the same route handler as an interactive request
(dispatch.py) at a low priority, a bounded number at a time (worker.py), its outputs appended
to disk with a journal that lets a restarted server go on from the lines not yet written
(journal.py); routes.py serves them, runner.py starts and resumes them."""
