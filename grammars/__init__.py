"""The grammar of the restopo language, shipped as package data."""
