"""Named device meshes, logical-axis sharding rules and the 3D-HybridEngine reshard."""
