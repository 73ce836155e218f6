"""The test kit for users' own actions files: a pytest plugin (plugin.py, registered as the ``pytest11``
entry point ``agent-outbox``) whose fixtures run the file through the real pipeline on the embedded
default against the sandbox provider (or a fake of the user's own), and count effects per key.

Nothing is imported here: merely having the package installed must cost a pytest run nothing.
"""
