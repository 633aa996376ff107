"""Every object store behind one interface: a `Location` opened from a URI (locations.py), by the
opener its scheme registered (schemes.py), with endpoints set once per process (settings.py).
Local folders, S3 (s3torchconnector; boto3 across forks), http(s) and fsspec filesystems; ranged
reads (ranged_reads.py), sinks that appear whole or not at all, checksums, access checks, doctor, redaction.
The bottom of the I/O stack: imports only config, cli_args, distributed and errors from bigclip.
"""
