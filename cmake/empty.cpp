// Placeholder translation unit for a library folder that has only headers.
