"""The local Apache Kafka broker (launcher) and topic administration (admin)."""
