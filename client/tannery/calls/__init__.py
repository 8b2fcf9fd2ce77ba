"""The call core: every call of the service, written once as steps (:mod:`tannery.rpc.waits`)
that the blocking :class:`tannery.Client` and the asyncio :class:`tannery.aio.Client` each
run their own way; what the calls carry besides tensors (alias watches, retention, the files
kept with an archive, a module's state_dict entries)."""
