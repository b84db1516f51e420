"""Serving the client listener until a stop: the grace for requests in flight (R-4.5, R-10.3).

A stop gives the requests in flight SHUTDOWN_GRACE seconds in all, then cancels the rest
(router/listener.py, `Listener.finish`).
"""

SHUTDOWN_GRACE = 15.0
