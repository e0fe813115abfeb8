#include "checkpoint/hdf5.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <hdf5.h>

#include <fcntl.h>

#include <mutex>

#include "checkpoint/dtype.h"
#include "checkpoint/fs.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::checkpoint::h5 {
namespace {

std::recursive_mutex& libraryMutex() {
  static std::recursive_mutex mutex;
  return mutex;
}

// Holds the library lock; the first use on each thread turns off HDF5's own
// printing of errors (check() reports them instead; the setting is per thread
// in thread-safe builds).
class Guard {
 public:
  Guard() : lock_(libraryMutex()) {
    // Before the library's first use: no clean-up of HDF5 at process exit. A
    // file whose close failed (a full disk) stays in HDF5's tables half torn
    // down, and the library's exit handler crashes closing it again (seen
    // with 1.10.8); the operating system reclaims everything anyway.
    static const bool noExitHandler = (H5dont_atexit(), true);
    (void)noExitHandler;
    thread_local bool silenced = false;
    if (!silenced) {
      H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
      silenced = true;
    }
  }

 private:
  std::lock_guard<std::recursive_mutex> lock_;
};

// HDF5's error stack, innermost call last, in one line; clears it.
std::string errorStack() {
  std::vector<std::string> lines;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned, const H5E_error2_t* error, void* data) -> herr_t {
        auto& out = *static_cast<std::vector<std::string>*>(data);
        char minor[128] = {0};
        H5Eget_msg(error->min_num, nullptr, minor, sizeof minor);
        out.push_back(fmt::format("{}: {}{}{}", error->func_name ? error->func_name : "?",
                                  error->desc ? error->desc : "", minor[0] ? " - " : "", minor));
        return 0;
      },
      &lines);
  H5Eclear2(H5E_DEFAULT);
  if (lines.empty()) return "no HDF5 error stack";
  if (lines.size() > 6) lines.erase(lines.begin() + 2, lines.end() - 4);
  return fmt::format("{}", fmt::join(lines, "; "));
}

// The one conversion of an HDF5 return code into a Bulkhead error.
template <typename T>
T check(T rc, const char* call, const std::string& what, const Where& where, Mode mode) {
  if (rc >= 0) return rc;
  std::string subject = where.key.empty() ? where.file : fmt::format("key '{}' in {}", where.key, where.file);
  std::string message = fmt::format("{} ({}) for {} failed: {}", what, call, subject, errorStack());
  if (mode == Mode::Write)
    throw IoError(message +
                      "; check free space and permissions of the checkpoint folder. This save is abandoned; "
                      "the previous checkpoint and `latest` stay as they were",
                  {.rank = where.rank, .expected = "a writable checkpoint folder with room"});
  throw CheckpointError(message + fmt::format("; the file is damaged, truncated or was replaced: run `bulkhead-ckpt "
                                              "verify {}`, restore the file from a copy, or load an older step",
                                              fs::parent(where.file)),
                        {.rank = where.rank, .expected = "an intact rank file written by this checkpoint"});
}

std::vector<hsize_t> toHsize(const std::vector<int64_t>& values) {
  return std::vector<hsize_t>(values.begin(), values.end());
}

}  // namespace

class Id {
 public:
  Id(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  ~Id() { release(); }
  hid_t get() const { return id_; }
  // Closes now; returns the library's status (the destructor ignores it).
  herr_t release() {
    if (id_ < 0) return 0;
    Guard guard;
    herr_t rc = close_(id_);
    id_ = -1;
    return rc;
  }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

namespace {

std::unique_ptr<Id> owned(hid_t id, herr_t (*close)(hid_t)) { return std::make_unique<Id>(id, close); }

std::unique_ptr<Id> fileType(c10::ScalarType dtype, const Where& where) {
  auto copy = [&](hid_t type) {
    return owned(check(H5Tcopy(type), "H5Tcopy", "a file type", where, Mode::Write), H5Tclose);
  };
  switch (dtype) {
    case c10::ScalarType::Float:
      return copy(H5T_IEEE_F32LE);
    case c10::ScalarType::Double:
      return copy(H5T_IEEE_F64LE);
    case c10::ScalarType::Long:
      return copy(H5T_STD_I64LE);
    case c10::ScalarType::Int:
      return copy(H5T_STD_I32LE);
    case c10::ScalarType::Short:
      return copy(H5T_STD_I16LE);
    case c10::ScalarType::Char:
      return copy(H5T_STD_I8LE);
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool:
      return copy(H5T_STD_U8LE);
    // HDF5 has no bfloat16: its bits as uint16 (the "dtype" attribute says bfloat16).
    case c10::ScalarType::BFloat16:
      return copy(H5T_STD_U16LE);
    case c10::ScalarType::Half: {
      // IEEE half the way h5py builds it, so h5py reads it as float16.
      auto type = copy(H5T_IEEE_F32LE);
      check(H5Tset_fields(type->get(), 15, 10, 5, 0, 10), "H5Tset_fields", "a float16 type", where, Mode::Write);
      check(H5Tset_size(type->get(), 2), "H5Tset_size", "a float16 type", where, Mode::Write);
      check(H5Tset_ebias(type->get(), 15), "H5Tset_ebias", "a float16 type", where, Mode::Write);
      return type;
    }
    default:
      requireStored(dtype);  // raises ConfigError naming the dtype
  }
  return nullptr;
}

void writeString(hid_t object, const std::string& name, const std::string& value, const Where& where) {
  std::string what = fmt::format("writing attribute '{}'", name);
  auto type = owned(check(H5Tcopy(H5T_C_S1), "H5Tcopy", what, where, Mode::Write), H5Tclose);
  std::string padded = value.empty() ? std::string(1, '\0') : value;
  check(H5Tset_size(type->get(), padded.size()), "H5Tset_size", what, where, Mode::Write);
  check(H5Tset_strpad(type->get(), H5T_STR_NULLPAD), "H5Tset_strpad", what, where, Mode::Write);
  auto space = owned(check(H5Screate(H5S_SCALAR), "H5Screate", what, where, Mode::Write), H5Sclose);
  auto attribute = owned(check(H5Acreate2(object, name.c_str(), type->get(), space->get(), H5P_DEFAULT, H5P_DEFAULT),
                               "H5Acreate2", what, where, Mode::Write),
                         H5Aclose);
  check(H5Awrite(attribute->get(), type->get(), padded.data()), "H5Awrite", what, where, Mode::Write);
}

void writeIntegers(hid_t object, const std::string& name, const std::vector<int64_t>& values, const Where& where) {
  std::string what = fmt::format("writing attribute '{}'", name);
  hsize_t count = values.size();
  auto space =
      owned(check(H5Screate_simple(1, &count, nullptr), "H5Screate_simple", what, where, Mode::Write), H5Sclose);
  auto attribute = owned(check(H5Acreate2(object, name.c_str(), H5T_STD_I64LE, space->get(), H5P_DEFAULT, H5P_DEFAULT),
                               "H5Acreate2", what, where, Mode::Write),
                         H5Aclose);
  if (count > 0)
    check(H5Awrite(attribute->get(), H5T_NATIVE_INT64, values.data()), "H5Awrite", what, where, Mode::Write);
}

std::unique_ptr<Id> openAttribute(hid_t object, const std::string& name, const Where& where) {
  std::string what = fmt::format("reading attribute '{}'", name);
  if (check(H5Aexists(object, name.c_str()), "H5Aexists", what, where, Mode::Read) == 0) return nullptr;
  return owned(check(H5Aopen(object, name.c_str(), H5P_DEFAULT), "H5Aopen", what, where, Mode::Read), H5Aclose);
}

std::optional<std::string> readString(hid_t object, const std::string& name, const Where& where) {
  auto attribute = openAttribute(object, name, where);
  if (!attribute) return std::nullopt;
  std::string what = fmt::format("reading attribute '{}'", name);
  auto type = owned(check(H5Aget_type(attribute->get()), "H5Aget_type", what, where, Mode::Read), H5Tclose);
  if (H5Tget_class(type->get()) != H5T_STRING || H5Tis_variable_str(type->get()) > 0) return std::nullopt;
  size_t size = H5Tget_size(type->get());
  std::string value(size, '\0');
  check(H5Aread(attribute->get(), type->get(), value.data()), "H5Aread", what, where, Mode::Read);
  value.erase(value.find_last_not_of('\0') + 1);
  return value;
}

}  // namespace

std::string datasetName(const std::string& key) {
  std::string name;
  for (char c : key) {
    if (c == '/')
      name += "%2F";
    else if (c == '%')
      name += "%25";
    else
      name += c;
  }
  return name == "." ? "%2E" : name;
}

Dataset::Dataset(std::unique_ptr<Id> id, Where where, Mode mode)
    : id_(std::move(id)), where_(std::move(where)), mode_(mode) {}
Dataset::Dataset(Dataset&&) noexcept = default;
Dataset::~Dataset() = default;

void Dataset::setAttribute(const std::string& name, const std::string& value) {
  Guard guard;
  writeString(id_->get(), name, value, where_);
}

void Dataset::setAttribute(const std::string& name, const std::vector<int64_t>& values) {
  Guard guard;
  writeIntegers(id_->get(), name, values, where_);
}

void Dataset::writeChunk(const std::vector<int64_t>& offsets, const void* data, size_t bytes) {
  Guard guard;
  auto at = toHsize(offsets);
  check(H5Dwrite_chunk(id_->get(), H5P_DEFAULT, 0, at.data(), bytes, data), "H5Dwrite_chunk",
        fmt::format("writing the chunk at [{}]", fmt::join(offsets, ", ")), where_, Mode::Write);
}

size_t Dataset::readChunk(const std::vector<int64_t>& offsets, void* buffer, size_t capacity) {
  Guard guard;
  auto at = toHsize(offsets);
  std::string what = fmt::format("reading the chunk at [{}]", fmt::join(offsets, ", "));
  hsize_t stored = 0;
  check(H5Dget_chunk_storage_size(id_->get(), at.data(), &stored), "H5Dget_chunk_storage_size", what, where_,
        Mode::Read);
  if (stored == 0 || stored > capacity)
    throw CheckpointError(
        fmt::format("{} for key '{}' in {}: the chunk is {} ({} bytes stored, {} expected); the file "
                    "is damaged or was not written by this checkpoint: run `bulkhead-ckpt verify {}`, "
                    "restore the file, or load an older step",
                    what, where_.key, where_.file, stored == 0 ? "missing" : "too large", stored, capacity,
                    fs::parent(where_.file)),
        {.rank = where_.rank, .expected = "every chunk of the dataset, of its planned size"});
  uint32_t filters = 0;
  check(H5Dread_chunk(id_->get(), H5P_DEFAULT, at.data(), &filters, buffer), "H5Dread_chunk", what, where_, Mode::Read);
  if (filters != 0)
    throw CheckpointError(fmt::format("{} for key '{}' in {}: the chunk was stored without its checksum (filter mask "
                                      "{}); the file was not written by Bulkhead or was modified",
                                      what, where_.key, where_.file, filters),
                          {.rank = where_.rank, .expected = "chunks stored through the Fletcher-32 filter"});
  return static_cast<size_t>(stored);
}

std::optional<Dataset::Location> Dataset::chunkLocation(const std::vector<int64_t>& offsets) {
  Guard guard;
  auto at = toHsize(offsets);
  Location location;
  haddr_t address = HADDR_UNDEF;
  hsize_t bytes = 0;
  check(H5Dget_chunk_info_by_coord(id_->get(), at.data(), &location.filterMask, &address, &bytes),
        "H5Dget_chunk_info_by_coord", fmt::format("locating the chunk at [{}]", fmt::join(offsets, ", ")), where_,
        Mode::Read);
  if (address == HADDR_UNDEF || bytes == 0) return std::nullopt;
  location.address = address;
  location.bytes = bytes;
  return location;
}

std::vector<int64_t> Dataset::dims() {
  Guard guard;
  auto space =
      owned(check(H5Dget_space(id_->get()), "H5Dget_space", "reading the shape", where_, Mode::Read), H5Sclose);
  int rank = check(H5Sget_simple_extent_ndims(space->get()), "H5Sget_simple_extent_ndims", "reading the shape", where_,
                   Mode::Read);
  std::vector<hsize_t> dims(rank);
  check(H5Sget_simple_extent_dims(space->get(), dims.data(), nullptr), "H5Sget_simple_extent_dims", "reading the shape",
        where_, Mode::Read);
  return std::vector<int64_t>(dims.begin(), dims.end());
}

std::vector<int64_t> Dataset::chunkDims() {
  Guard guard;
  auto plist =
      owned(check(H5Dget_create_plist(id_->get()), "H5Dget_create_plist", "reading the layout", where_, Mode::Read),
            H5Pclose);
  if (H5Pget_layout(plist->get()) != H5D_CHUNKED) return {};
  hsize_t chunk[H5S_MAX_RANK];
  int rank =
      check(H5Pget_chunk(plist->get(), H5S_MAX_RANK, chunk), "H5Pget_chunk", "reading the layout", where_, Mode::Read);
  return std::vector<int64_t>(chunk, chunk + rank);
}

bool Dataset::fletcher32Only() {
  Guard guard;
  auto plist =
      owned(check(H5Dget_create_plist(id_->get()), "H5Dget_create_plist", "reading the filters", where_, Mode::Read),
            H5Pclose);
  if (H5Pget_nfilters(plist->get()) != 1) return false;
  unsigned flags = 0, config = 0;
  size_t values = 0;
  return H5Pget_filter2(plist->get(), 0, &flags, &values, nullptr, 0, nullptr, &config) == H5Z_FILTER_FLETCHER32;
}

int64_t Dataset::fileElementSize() {
  Guard guard;
  auto type = owned(check(H5Dget_type(id_->get()), "H5Dget_type", "reading the type", where_, Mode::Read), H5Tclose);
  return static_cast<int64_t>(H5Tget_size(type->get()));
}

std::optional<std::string> Dataset::stringAttribute(const std::string& name) {
  Guard guard;
  return readString(id_->get(), name, where_);
}

std::optional<std::vector<int64_t>> Dataset::integersAttribute(const std::string& name) {
  Guard guard;
  auto attribute = openAttribute(id_->get(), name, where_);
  if (!attribute) return std::nullopt;
  std::string what = fmt::format("reading attribute '{}'", name);
  auto space = owned(check(H5Aget_space(attribute->get()), "H5Aget_space", what, where_, Mode::Read), H5Sclose);
  hssize_t count =
      check(H5Sget_simple_extent_npoints(space->get()), "H5Sget_simple_extent_npoints", what, where_, Mode::Read);
  std::vector<int64_t> values(static_cast<size_t>(count));
  if (count > 0) check(H5Aread(attribute->get(), H5T_NATIVE_INT64, values.data()), "H5Aread", what, where_, Mode::Read);
  return values;
}

File::File(std::unique_ptr<Id> id, Where where, Mode mode)
    : id_(std::move(id)), where_(std::move(where)), mode_(mode) {}
File::File(File&&) noexcept = default;

File::~File() {
  if (!id_ || id_->get() < 0) return;
  Guard guard;
  if (id_->release() < 0) log::warn("checkpoint", "closing {} failed: {}", where_.file, errorStack());
}

File File::create(const std::string& path, int rank) {
  Guard guard;
  Where where{.file = path, .rank = rank};
  auto fapl = owned(check(H5Pcreate(H5P_FILE_ACCESS), "H5Pcreate", "creating the file", where, Mode::Write), H5Pclose);
  check(H5Pset_libver_bounds(fapl->get(), H5F_LIBVER_V110, H5F_LIBVER_V110), "H5Pset_libver_bounds",
        "creating the file", where, Mode::Write);
  hid_t file = check(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl->get()), "H5Fcreate", "creating the file",
                     where, Mode::Write);
  return File(owned(file, H5Fclose), where, Mode::Write);
}

File File::open(const std::string& path, int rank) {
  Guard guard;
  Where where{.file = path, .rank = rank};
  hid_t file =
      check(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "H5Fopen", "opening the file", where, Mode::Read);
  return File(owned(file, H5Fclose), where, Mode::Read);
}

void File::setAttribute(const std::string& name, const std::string& value) {
  Guard guard;
  writeString(id_->get(), name, value, where_);
}

std::optional<std::string> File::stringAttribute(const std::string& name) {
  Guard guard;
  return readString(id_->get(), name, where_);
}

Dataset File::createDataset(const std::string& name, const std::string& key, const ChunkPlan& plan,
                            c10::ScalarType dtype) {
  Guard guard;
  Where where{.file = where_.file, .key = key, .rank = where_.rank};
  const char* what = "creating the dataset";
  auto type = fileType(dtype, where);
  auto dcpl = owned(check(H5Pcreate(H5P_DATASET_CREATE), "H5Pcreate", what, where, Mode::Write), H5Pclose);
  if (plan.count > 0) {
    auto chunk = toHsize(plan.chunk);
    check(H5Pset_chunk(dcpl->get(), static_cast<int>(chunk.size()), chunk.data()), "H5Pset_chunk", what, where,
          Mode::Write);
    check(H5Pset_fletcher32(dcpl->get()), "H5Pset_fletcher32", what, where, Mode::Write);
  }
  check(H5Pset_fill_time(dcpl->get(), H5D_FILL_TIME_NEVER), "H5Pset_fill_time", what, where, Mode::Write);
  auto dims = toHsize(plan.dims);
  auto space = owned(check(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), "H5Screate_simple",
                           what, where, Mode::Write),
                     H5Sclose);
  hid_t dataset =
      check(H5Dcreate2(id_->get(), name.c_str(), type->get(), space->get(), H5P_DEFAULT, dcpl->get(), H5P_DEFAULT),
            "H5Dcreate2", what, where, Mode::Write);
  return Dataset(owned(dataset, H5Dclose), where, Mode::Write);
}

Dataset File::openDataset(const std::string& name, const std::string& key) {
  Guard guard;
  Where where{.file = where_.file, .key = key, .rank = where_.rank};
  hid_t dataset = check(H5Dopen2(id_->get(), name.c_str(), H5P_DEFAULT), "H5Dopen2",
                        fmt::format("opening dataset '{}'", name), where, Mode::Read);
  return Dataset(owned(dataset, H5Dclose), where, Mode::Read);
}

void File::startWriteback() {
#ifdef __linux__
  Guard guard;
  void* handle = nullptr;
  if (H5Fget_vfd_handle(id_->get(), H5P_DEFAULT, &handle) < 0 || handle == nullptr) {
    H5Eclear2(H5E_DEFAULT);
    return;
  }
  ::sync_file_range(*static_cast<int*>(handle), 0, 0, SYNC_FILE_RANGE_WRITE);
#endif
}

void File::close() {
  if (!id_ || id_->get() < 0) return;
  Guard guard;
  check(id_->release(), "H5Fclose", "closing the file", where_, mode_);
}

}  // namespace bulkhead::checkpoint::h5
