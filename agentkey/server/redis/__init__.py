"""The Redis store of the server half (redis-py); ``agentkey.server.RedisStore`` loads it."""
