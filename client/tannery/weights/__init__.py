"""Weight sync: a :class:`Publisher` pushes versions of a model's weights; each
:class:`Follower` (or :class:`AsyncFollower`) applies the newest, whole and in place
(docs/weight-sync.md). Built on the call core; see :mod:`.followers` and :mod:`.versions`."""

from tannery.weights.followers import Applied, AsyncFollower, AsyncPublisher, Follower, Publisher, Pushed

__all__ = ["Applied", "AsyncFollower", "AsyncPublisher", "Follower", "Publisher", "Pushed"]
