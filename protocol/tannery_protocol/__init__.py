"""tannery's protocol: what a tannery client and server share, importing neither.

The tannic payload format (:mod:`.codec`) and its framing in a stream of chunks
(:mod:`.framing`), the gRPC messages written and read without copies (:mod:`.wire`) and
their generated modules (:mod:`.v1`), the frames of a data connection (:mod:`.datalink`),
block checksums (:mod:`.checksums`), entry names (:mod:`.names`), the messages of a
mismatch (:mod:`.mismatches`) and the exceptions of the API (:mod:`.errors`). Nothing here
imports torch.
"""
