"""The Batch API's folder (`--batch-dir`): uploaded files and their records (files.py), batch
records (batches.py), each running batch's results and journal (journal.py), its input read
line by line (lines.py), its token sums (usage.py). Every name under it is one this package
makes (`file-…`, `batch_…`), never one a request sends; the HTTP side (api/batches/) reaches the
disk only through it."""
