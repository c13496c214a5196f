"""The run configuration: its typed schema (``schema``) and how it is loaded, overridden,
validated and saved (``io``). Read by the trainer and the CLIs, never by the engine."""
