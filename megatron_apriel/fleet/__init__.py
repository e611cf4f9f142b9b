"""Access to the vLLM fleet, shared by the actor, the trainer's weight pushes and evaluation: the
HTTP client that spreads requests over healthy servers (``client``), discovery through the run
directory and locally started servers (``registry``), and their settings (``config``)."""
