// The translation unit the precompiled headers are built with (cmake/BulkheadPch.cmake).
