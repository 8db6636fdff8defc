"""Real servers that tests and benchmarks stand Switchyard in front of.

Nothing here is imported by the services themselves.
"""
