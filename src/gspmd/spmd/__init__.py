"""The toolkit partition rules use: device context and collectives, partitioned values,
resharding, padding and masking, and the dimension-factor machinery."""
