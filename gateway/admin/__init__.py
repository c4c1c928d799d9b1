"""Operating tokengate live: the admin API, its tokens, and the state it keeps across replicas."""
