"""The shell: the only part that owns mutable resources (the KV pool and its book, the request
table, the waiting queue). It runs the state core's transitions and applies their effects."""
