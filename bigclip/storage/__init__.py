"""Objects in a local folder, under an S3 prefix (s3torchconnector, or boto3 for background threads)
or on any fsspec filesystem: locations, ranged reads (blobs), sinks that
appear whole or not at all, checksums, S3 settings and clients, preflight, doctor, redaction.
The bottom of the I/O stack: imports only config, distributed and errors from bigclip.
"""
