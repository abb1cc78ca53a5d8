"""`kvpool router`: sends each request to the replica holding the longest prefix of it."""
