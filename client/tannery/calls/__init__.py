"""The call core: every call of the service, written once as steps (:mod:`tannery.rpc.waits`)
that the blocking :class:`tannery.Client` and the asyncio :class:`tannery.aio.Client` each
run their own way; alias watches, retention, and a state_dict's entries for a module."""
