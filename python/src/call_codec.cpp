// The Python op wire format, both ends (call_codec.hpp).
#include "call_codec.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <unordered_map>
#include <utility>

namespace gpuq::python::codec {

using namespace nb::literals;

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

namespace {

constexpr std::array<char, 4> kCallMagic = {'G', 'Q', 'C', '2'};
constexpr std::array<char, 4> kAnswerMagic = {'G', 'Q', 'R', '2'};
constexpr uint64_t kCallFixed = 16;    // magic, flags, counts
constexpr uint64_t kAnswerFixed = 20;  // magic, length, kind, count, extra length
constexpr uint64_t kReleaseGilBytes = 4 << 20;
constexpr size_t kCacheLimit = 1024;

enum Tag : uint8_t {
  kTagNone = 0,
  kTagFalse = 1,
  kTagTrue = 2,
  kTagInt = 3,
  kTagFloat = 4,
  kTagStr = 5,
  kTagJson = 6,
  kTagArray = 7,
  kTagBytes = 8,
};

constexpr std::array<const char*, kKindCount> kKindNames = {"none", "array",  "scalar",    "tuple",
                                                            "json", "pickle", "exception", "error"};

// What the codec uses of numpy, json, pickle and gpuq._wire, looked up once (GIL held).
struct PyRefs {
  nb::object ndarray;
  nb::object generic;
  nb::object asarray;
  nb::object ascontiguousarray;
  nb::object pickle_buffer;
  nb::object json_loads;
  nb::object json_text;      // _wire.json_text(value, what) -> str, TypeError when not JSON-able
  nb::object dtype_text;     // _wire.dtype_text(dtype) -> str, TypeError for object dtypes
  nb::object dtype_of_text;  // _wire.dtype_of_text(str) -> dtype, ValueError when not one
  nb::object empty_tuple;
};

const PyRefs& py() {
  static PyRefs* refs = [] {
    auto* r = new PyRefs();  // leaked: used until the interpreter exits
    nb::module_ np = nb::module_::import_("numpy");
    r->ndarray = np.attr("ndarray");
    r->generic = np.attr("generic");
    r->asarray = np.attr("asarray");
    r->ascontiguousarray = np.attr("ascontiguousarray");
    r->pickle_buffer = nb::module_::import_("pickle").attr("PickleBuffer");
    r->json_loads = nb::module_::import_("json").attr("loads");
    nb::module_ wire = nb::module_::import_("gpuq._wire");  // a leaf: no import circle
    r->json_text = wire.attr("json_text");
    r->dtype_text = wire.attr("dtype_text");
    r->dtype_of_text = wire.attr("dtype_of_text");
    r->empty_tuple = nb::steal(PyTuple_New(0));
    return r;
  }();
  return *refs;
}

[[noreturn]] void malformed(const std::string& what) {
  throw std::invalid_argument(what);
}

// The message of a caught Python exception (which goes with `e`), for an invalid_argument.
std::string python_message(const nb::python_error& e) {
  return nb::cast<std::string>(nb::str(e.value()));
}

// A str of UTF-8 bytes a peer wrote; invalid_argument naming `what` when they are not UTF-8.
nb::object utf8(std::string_view s, const std::string& what) {
  nb::object o =
      nb::steal(PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "strict"));
  if (!o.is_valid()) {
    PyErr_Clear();
    malformed(what + ": not UTF-8");
  }
  return o;
}

// A held Py_buffer, released with its holder.
struct HeldBuffer {
  Py_buffer view{};
  bool held = false;
  HeldBuffer() = default;
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  ~HeldBuffer() { release(); }
  bool get(PyObject* o, int flags) {
    release();
    held = PyObject_GetBuffer(o, &view, flags) == 0;
    return held;
  }
  void release() {
    if (held) PyBuffer_Release(&view);
    held = false;
  }
};

// dtype object -> its text (dtype_text), by the object's address; the entry holds the dtype.
struct TextEntry {
  nb::object dtype;
  std::string text;
};
std::unordered_map<PyObject*, TextEntry>& text_cache() {
  static auto* m = new std::unordered_map<PyObject*, TextEntry>();
  return *m;
}

const std::string& dtype_text(nb::handle dtype) {
  auto& cache = text_cache();
  if (auto it = cache.find(dtype.ptr()); it != cache.end()) return it->second.text;
  std::string text = nb::cast<std::string>(py().dtype_text(dtype));  // TypeError: object dtype
  if (cache.size() >= kCacheLimit) cache.clear();
  return cache.emplace(dtype.ptr(), TextEntry{nb::borrow(dtype), std::move(text)})
      .first->second.text;
}

// text -> (dtype, itemsize): the dtypes of decoded entries.
struct DtypeEntry {
  nb::object dtype;
  uint64_t itemsize;
};
const DtypeEntry& dtype_of(std::string_view text, const std::string& what) {
  static auto* cache = new std::unordered_map<std::string, DtypeEntry>();
  if (auto it = cache->find(std::string(text)); it != cache->end()) return it->second;
  nb::object dt;
  try {
    dt = py().dtype_of_text(utf8(text, what + ": the dtype"));
  } catch (nb::python_error& e) {
    malformed(what + ": " + python_message(e));
  }
  const auto itemsize = nb::cast<uint64_t>(dt.attr("itemsize"));
  if (cache->size() >= kCacheLimit) cache->clear();
  return cache->emplace(std::string(text), DtypeEntry{std::move(dt), itemsize}).first->second;
}

// ---- writing and reading bytes ----------------------------------------------------------------

class Writer {
 public:
  explicit Writer(std::byte* p) : p_(p) {}
  template <typename T>
  void put(T v) {
    std::memcpy(p_, &v, sizeof v);
    p_ += sizeof v;
  }
  void bytes(std::string_view s) {
    std::memcpy(p_, s.data(), s.size());
    p_ += s.size();
  }

 private:
  std::byte* p_;
};

class Reader {
 public:
  Reader(const std::byte* p, uint64_t n, const char* what) : p_(p), end_(p + n), what_(what) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof v);
    p_ += sizeof v;
    return v;
  }
  std::string_view bytes(uint64_t n) {
    need(n);
    std::string_view s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  uint64_t left() const { return static_cast<uint64_t>(end_ - p_); }

 private:
  void need(uint64_t n) const {
    if (left() < n) malformed(std::string(what_) + " is cut short");
  }
  const std::byte* p_;
  const std::byte* end_;
  const char* what_;
};

// An array entry's shape and offset as read, checked against a buffer of `size` bytes before
// anything is computed from them.
struct ArrayRef {
  const DtypeEntry* dtype;
  std::vector<uint64_t> shape;
  uint64_t offset;
};

ArrayRef read_array(Reader& r, uint64_t size, const std::string& what) {
  const auto dlen = r.get<uint16_t>();
  const std::string_view text = r.bytes(dlen);
  const auto ndim = r.get<uint8_t>();
  if (ndim > kMaxDims) {
    malformed(what + ": " + std::to_string(ndim) + " dimensions, more than " +
              std::to_string(kMaxDims));
  }
  ArrayRef a{nullptr, std::vector<uint64_t>(ndim), 0};
  uint64_t count = 1;
  bool empty = false;
  for (auto& d : a.shape) {
    d = r.get<uint64_t>();
    if (d > size && d != 0) {
      malformed(what + ": a dimension of " + std::to_string(d) + " is larger than the " +
                std::to_string(size) + "-byte buffer");
    }
    if (d == 0) empty = true;
    // Each dimension is at most `size` (< 2^63): the product is checked before it overflows.
    if (!empty && count > size / std::max<uint64_t>(d, 1)) count = size + 1;
    if (!empty && count <= size) count *= d;
  }
  if (empty) count = 0;
  a.offset = r.get<uint64_t>();
  a.dtype = &dtype_of(text, what);
  if (a.offset > size ||
      (a.dtype->itemsize != 0 && count > (size - a.offset) / a.dtype->itemsize)) {
    malformed(what + ": the array [" + std::to_string(a.offset) + ", +" + std::to_string(count) +
              " x " + std::to_string(a.dtype->itemsize) + " bytes) lies outside the " +
              std::to_string(size) + "-byte buffer");
  }
  return a;
}

// numpy.ndarray(shape, dtype, buffer=base, offset=off): a view, zero copy (read-only when the
// buffer is).
nb::object array_view(const ArrayRef& a, nb::handle base) {
  nb::object shape = nb::steal(PyTuple_New(static_cast<Py_ssize_t>(a.shape.size())));
  for (size_t i = 0; i < a.shape.size(); ++i) {
    PyTuple_SET_ITEM(shape.ptr(), static_cast<Py_ssize_t>(i),
                     PyLong_FromUnsignedLongLong(a.shape[i]));
  }
  return py().ndarray(shape, a.dtype->dtype, "buffer"_a = base, "offset"_a = a.offset);
}

// ---- arrays going out -----------------------------------------------------------------------

// An array on its way into a header and a buffer: C-contiguous (a copy made when it was not).
struct OutArray {
  nb::object array;
  HeldBuffer buffer;
  std::string text;  // dtype text
  std::vector<uint64_t> shape;

  uint64_t nbytes() const { return static_cast<uint64_t>(buffer.view.len); }
  uint64_t entry_bytes() const { return 2 + text.size() + 1 + 8 * shape.size() + 8; }
  void write_entry(Writer& w, uint64_t offset) const {
    w.put<uint16_t>(static_cast<uint16_t>(text.size()));
    w.bytes(text);
    w.put<uint8_t>(static_cast<uint8_t>(shape.size()));
    for (uint64_t d : shape) w.put<uint64_t>(d);
    w.put<uint64_t>(offset);
  }
};

// Fills `a` from a numpy array. TypeError (a Python error) for an object dtype.
void take_array(OutArray& a, nb::handle array) {
  a.array = nb::borrow(array);
  if (!a.buffer.get(a.array.ptr(), PyBUF_C_CONTIGUOUS)) {
    PyErr_Clear();
    a.array = py().ascontiguousarray(a.array);
    if (!a.buffer.get(a.array.ptr(), PyBUF_C_CONTIGUOUS)) throw nb::python_error();
  }
  a.text = dtype_text(a.array.attr("dtype"));
  if (a.text.size() > UINT16_MAX) throw std::invalid_argument("a dtype's description is too long");
  const auto& v = a.buffer.view;
  if (v.ndim < 0 || static_cast<uint32_t>(v.ndim) > kMaxDims) {
    throw std::invalid_argument("an array of more than 64 dimensions");
  }
  a.shape.resize(static_cast<size_t>(v.ndim));
  for (int i = 0; i < v.ndim; ++i)
    a.shape[static_cast<size_t>(i)] = static_cast<uint64_t>(v.shape[i]);
}

bool is_instance(nb::handle o, const nb::object& type) {
  const int r = PyObject_IsInstance(o.ptr(), type.ptr());
  if (r < 0) throw nb::python_error();
  return r == 1;
}

}  // namespace

const char* kind_name(Kind k) {
  const auto i = static_cast<uint32_t>(k);
  return i < kKindCount ? kKindNames[i] : "?";
}

std::optional<Kind> kind_of(std::string_view name) {
  for (uint32_t i = 0; i < kKindCount; ++i) {
    if (name == kKindNames[i]) return static_cast<Kind>(i);
  }
  return std::nullopt;
}

uint64_t align(uint64_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

// ---- CallPlan ---------------------------------------------------------------------------------

struct CallPlan::Entry {
  std::string key;  // a keyword's name (UTF-8)
  Tag tag = kTagNone;
  int64_t i = 0;
  double d = 0;
  nb::object text_owner;  // the str whose UTF-8 `text` is
  std::string_view text;  // str or JSON
  OutArray array;         // kTagArray; kTagBytes uses its buffer only
  bool in_place = false;
  uint64_t arena_offset = 0;

  uint64_t bytes() const {
    const uint64_t n = 1;  // the tag (a keyword's name is counted by the caller)
    switch (tag) {
      case kTagInt:
      case kTagFloat:
        return n + 8;
      case kTagStr:
      case kTagJson:
        return n + 4 + text.size();
      case kTagArray:
        return n + array.entry_bytes();
      case kTagBytes:
        return n + 16;
      default:
        return n;
    }
  }
};

CallPlan::CallPlan(nb::handle args, nb::handle kwargs, uint32_t flags, bool copy_all,
                   const std::byte* arena, uint64_t arena_bytes)
    : flags_(flags), copy_all_(copy_all), arena_(arena), arena_bytes_(arena_bytes) {
  if (!PyTuple_Check(args.ptr())) throw std::invalid_argument("args must be a tuple");
  const Py_ssize_t n = PyTuple_GET_SIZE(args.ptr());
  const Py_ssize_t k = kwargs.is_none() ? 0 : PyDict_Size(kwargs.ptr());
  if (k < 0) throw nb::python_error();
  entries_.reserve(static_cast<size_t>(n + k));
  for (Py_ssize_t i = 0; i < n; ++i) {
    add(nb::handle(), PyTuple_GET_ITEM(args.ptr(), i), "argument " + std::to_string(i));
  }
  positional_ = static_cast<uint32_t>(n);
  if (k > 0) {
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs.ptr(), &pos, &key, &value)) {
      if (!PyUnicode_Check(key)) throw std::invalid_argument("a keyword's name is not a str");
      add(key, value, "keyword " + nb::cast<std::string>(nb::handle(key)));
    }
  }
  keywords_ = static_cast<uint32_t>(k);
  for (const auto& e : entries_)
    header_bytes_ += e->bytes() + (e->key.empty() ? 0 : 2 + e->key.size());
  if (header_bytes_ > kMaxHeaderBytes) {
    throw std::invalid_argument("the call's arguments take " + std::to_string(header_bytes_) +
                                " header bytes, more than " + std::to_string(kMaxHeaderBytes) +
                                ": pass large data as numpy arrays");
  }
}

CallPlan::~CallPlan() = default;

void CallPlan::add(nb::handle key, nb::handle v, const std::string& what) {
  Entry& e = *entries_.emplace_back(std::make_unique<Entry>());
  if (key.is_valid()) {
    Py_ssize_t len = 0;
    const char* s = PyUnicode_AsUTF8AndSize(key.ptr(), &len);
    if (s == nullptr) throw nb::python_error();
    if (len == 0 || len > UINT16_MAX) {
      throw std::invalid_argument(what + ": a keyword's name must be 1 to 65535 bytes");
    }
    e.key.assign(s, static_cast<size_t>(len));
  }
  PyObject* o = v.ptr();
  if (o == Py_None) {
    e.tag = kTagNone;
    return;
  }
  if (o == Py_True || o == Py_False) {
    e.tag = o == Py_True ? kTagTrue : kTagFalse;
    return;
  }
  if (PyLong_CheckExact(o)) {
    int overflow = 0;
    e.i = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
      e.tag = kTagInt;
      return;
    }
  } else if (PyFloat_CheckExact(o)) {
    e.tag = kTagFloat;
    e.d = PyFloat_AS_DOUBLE(o);
    return;
  } else if (PyUnicode_CheckExact(o)) {
    Py_ssize_t len = 0;
    const char* s = PyUnicode_AsUTF8AndSize(o, &len);
    if (s != nullptr) {
      e.tag = kTagStr;
      e.text_owner = nb::borrow(v);
      e.text = std::string_view(s, static_cast<size_t>(len));
      return;
    }
    PyErr_Clear();  // not UTF-8 (a lone surrogate): as JSON, which escapes it
  } else if (Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(py().ndarray.ptr()) ||
             is_instance(v, py().ndarray) || is_instance(v, py().generic)) {
    e.tag = kTagArray;
    nb::object a = Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(py().ndarray.ptr())
                       ? nb::borrow(v)
                       : py().asarray(v);
    try {
      take_array(e.array, a);
    } catch (nb::python_error& err) {
      if (!err.matches(PyExc_TypeError)) throw;
      throw std::invalid_argument(what + ": " + python_message(err) +
                                  "; Python ops take arrays of plain numbers");
    } catch (const std::invalid_argument& err) {
      throw std::invalid_argument(what + ": " + err.what());
    }
    // In place when it lies wholly in this client's arena (addresses compared as integers:
    // the array's memory may be anywhere).
    const auto p = reinterpret_cast<uintptr_t>(e.array.buffer.view.buf);
    const auto base = reinterpret_cast<uintptr_t>(arena_);
    const uint64_t len = e.array.nbytes();
    if (!copy_all_ && len > 0 && arena_ != nullptr && p >= base && p - base <= arena_bytes_ &&
        len <= arena_bytes_ - (p - base)) {
      e.in_place = true;
      e.arena_offset = p - base;
    } else {
      copy_bytes_ += align(len);
    }
    return;
  } else if (PyBytes_Check(o) || PyByteArray_Check(o) || PyMemoryView_Check(o) ||
             is_instance(v, py().pickle_buffer)) {
    e.tag = kTagBytes;
    e.array.array = nb::borrow(v);
    if (!e.array.buffer.get(o, PyBUF_C_CONTIGUOUS)) {
      PyErr_Clear();
      throw std::invalid_argument(what + ": a buffer that is not C-contiguous");
    }
    copy_bytes_ += align(e.array.nbytes());
    return;
  }
  // Anything else travels as JSON (lists, dicts, large ints, subclasses of the plain types).
  try {
    e.text_owner = py().json_text(v, what.c_str());
  } catch (nb::python_error& err) {
    if (!err.matches(PyExc_TypeError) && !err.matches(PyExc_ValueError)) throw;
    throw std::invalid_argument(python_message(err));
  }
  Py_ssize_t len = 0;
  const char* s = PyUnicode_AsUTF8AndSize(e.text_owner.ptr(), &len);
  if (s == nullptr) throw nb::python_error();
  e.tag = kTagJson;
  e.text = std::string_view(s, static_cast<size_t>(len));
}

uint64_t CallPlan::block_bytes(uint64_t output_bytes) const {
  return align(header_bytes_) + copy_bytes_ + output_bytes;
}

CallPlan::Layout CallPlan::write(std::byte* arena, uint64_t block_offset) {
  uint64_t at = block_offset + align(header_bytes_);
  uint64_t start = block_offset;
  uint64_t end = at + copy_bytes_;
  uint64_t rows = 0;
  bool first = true;
  for (auto& ep : entries_) {
    Entry& e = *ep;
    if (e.tag != kTagArray && e.tag != kTagBytes) continue;
    if (e.tag == kTagArray) {
      const auto& shape = e.array.shape;
      const uint64_t r = shape.empty() ? 0 : shape[0];
      rows = first ? r : (r == rows ? rows : 0);
      if (shape.empty()) rows = 0;
      first = false;
    }
    if (e.in_place) {
      start = std::min(start, e.arena_offset);
      end = std::max(end, e.arena_offset + e.array.nbytes());
    } else {
      e.arena_offset = at;
      at += align(e.array.nbytes());
    }
  }
  // Positional then keyword entries, in the order they were added.
  Writer w(arena + block_offset);
  w.bytes(std::string_view(kCallMagic.data(), kCallMagic.size()));
  w.put<uint32_t>(flags_);
  w.put<uint32_t>(positional_);
  w.put<uint32_t>(keywords_);
  for (const auto& ep : entries_) {
    const Entry& e = *ep;
    if (!e.key.empty()) {
      w.put<uint16_t>(static_cast<uint16_t>(e.key.size()));
      w.bytes(e.key);
    }
    w.put<uint8_t>(e.tag);
    switch (e.tag) {
      case kTagInt:
        w.put<int64_t>(e.i);
        break;
      case kTagFloat:
        w.put<double>(e.d);
        break;
      case kTagStr:
      case kTagJson:
        w.put<uint32_t>(static_cast<uint32_t>(e.text.size()));
        w.bytes(e.text);
        break;
      case kTagArray:
        e.array.write_entry(w, e.arena_offset - start);
        break;
      case kTagBytes:
        w.put<uint64_t>(e.arena_offset - start);
        w.put<uint64_t>(e.array.nbytes());
        break;
      default:
        break;
    }
  }
  auto copy = [&] {
    for (const auto& ep : entries_) {
      const Entry& e = *ep;
      if ((e.tag == kTagArray || e.tag == kTagBytes) && !e.in_place && e.array.nbytes() > 0) {
        std::memcpy(arena + e.arena_offset, e.array.buffer.view.buf, e.array.nbytes());
      }
    }
  };
  if (copy_bytes_ >= kReleaseGilBytes) {
    // The buffers stay exported (and their objects referenced) while the GIL is let go.
    nb::gil_scoped_release unlocked;
    copy();
  } else {
    copy();
  }
  return Layout{start, end - start, block_offset - start, header_bytes_, at, rows};
}

nb::list CallPlan::in_place() const {
  nb::list out;
  for (const auto& ep : entries_) {
    const Entry& e = *ep;
    if (e.in_place) out.append(e.array.array);
  }
  return out;
}

// ---- answers: the client reads --------------------------------------------------------------

namespace {

struct Answer {
  Kind kind;
  std::vector<ArrayRef> arrays;
  std::string_view extra;
};

Answer parse_answer(const std::byte* p, uint64_t nbytes) {
  if (nbytes < kAnswerFixed || std::memcmp(p, kAnswerMagic.data(), 4) != 0) {
    malformed("the worker's answer is missing or malformed (no GQR2 header)");
  }
  Reader r(p + 4, nbytes - 4, "the worker's answer");
  const auto length = r.get<uint32_t>();
  if (length < kAnswerFixed || length > nbytes) {
    malformed("the worker's answer has a header of " + std::to_string(length) + " bytes in a " +
              std::to_string(nbytes) + "-byte answer");
  }
  Reader h(p + 8, length - 8, "the worker's answer header");
  const auto kind = h.get<uint32_t>();
  if (kind >= kKindCount) malformed("the worker's answer has kind " + std::to_string(kind));
  const auto count = h.get<uint32_t>();
  const auto extra_len = h.get<uint32_t>();
  Answer a{static_cast<Kind>(kind), {}, h.bytes(extra_len)};
  if (count > h.left()) malformed("the worker's answer lists more arrays than it holds");
  a.arrays.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    a.arrays.push_back(read_array(h, nbytes, "the answer's array " + std::to_string(i)));
  }
  return a;
}

struct OutBytes {
  HeldBuffer buffer;
  explicit OutBytes(nb::handle out, uint64_t nbytes) {
    if (!buffer.get(out.ptr(), PyBUF_SIMPLE)) throw nb::python_error();
    if (nbytes > static_cast<uint64_t>(buffer.view.len)) {
      throw std::invalid_argument("the answer's size is past its buffer");
    }
  }
  const std::byte* data() const { return static_cast<const std::byte*>(buffer.view.buf); }
};

nb::object scalar_of(nb::handle array) {
  return nb::steal(PyObject_GetItem(array.ptr(), py().empty_tuple.ptr()));
}

}  // namespace

nb::object answer_value(nb::handle out, uint64_t nbytes) {
  const OutBytes bytes(out, nbytes);
  const Answer a = parse_answer(bytes.data(), nbytes);
  switch (a.kind) {
    case Kind::kNone:
      return nb::none();
    case Kind::kArray:
    case Kind::kScalar: {
      if (a.arrays.size() != 1) malformed("the worker's answer must hold one array");
      nb::object v = array_view(a.arrays[0], out);
      return a.kind == Kind::kArray ? v : scalar_of(v);
    }
    case Kind::kTuple: {
      nb::object t = nb::steal(PyTuple_New(static_cast<Py_ssize_t>(a.arrays.size())));
      for (size_t i = 0; i < a.arrays.size(); ++i) {
        nb::object v = array_view(a.arrays[i], out);
        if (a.arrays[i].shape.empty()) v = scalar_of(v);
        PyTuple_SET_ITEM(t.ptr(), static_cast<Py_ssize_t>(i), v.release().ptr());
      }
      return t;
    }
    case Kind::kJson: {
      nb::object extra = py().json_loads(utf8(a.extra, "the answer's JSON"));
      if (!PyDict_Check(extra.ptr()) || !nb::borrow<nb::dict>(extra).contains("value")) {
        malformed("the worker's JSON answer has no value");
      }
      return extra["value"];
    }
    default:
      malformed(std::string("a named op's answer of kind ") + kind_name(a.kind));
  }
}

nb::tuple read_answer(nb::handle out, uint64_t nbytes) {
  const OutBytes bytes(out, nbytes);
  const Answer a = parse_answer(bytes.data(), nbytes);
  nb::list arrays;
  for (const ArrayRef& r : a.arrays) arrays.append(array_view(r, out));
  return nb::make_tuple(kind_name(a.kind), arrays, utf8(a.extra, "the answer's JSON"));
}

// ---- the worker's side ------------------------------------------------------------------------

nb::tuple decode_call(nb::handle input, uint64_t h, uint64_t n, bool buffers_as_views) {
  HeldBuffer in;
  if (!in.get(input.ptr(), PyBUF_SIMPLE)) throw nb::python_error();
  const auto size = static_cast<uint64_t>(in.view.len);
  if (h > size || n > size - h) {
    malformed("the header [" + std::to_string(h) + ", +" + std::to_string(n) +
              ") lies outside the job's " + std::to_string(size) + "-byte input");
  }
  if (n > kMaxHeaderBytes) {
    malformed("the header is " + std::to_string(n) + " bytes, more than " +
              std::to_string(kMaxHeaderBytes) + ": pass large data as numpy arrays");
  }
  const auto* base = static_cast<const std::byte*>(in.view.buf);
  if (n < kCallFixed || std::memcmp(base + h, kCallMagic.data(), 4) != 0) {
    malformed("the header does not start with GQC2 (a client of another gpuq version?)");
  }
  Reader r(base + h + 4, n - 4, "the header");
  const auto flags = r.get<uint32_t>();
  const auto positional = r.get<uint32_t>();
  const auto keywords = r.get<uint32_t>();
  if (positional > r.left() || keywords > r.left() - positional) {
    malformed("the header lists more arguments than it holds");
  }
  nb::object args = nb::steal(PyList_New(positional));
  nb::dict kwargs;
  for (uint64_t i = 0; i < uint64_t{positional} + keywords; ++i) {
    std::string what;
    nb::object key;
    if (i >= positional) {
      const auto klen = r.get<uint16_t>();
      const std::string_view k = r.bytes(klen);
      key = utf8(k, "a keyword's name");
      what = "keyword " + std::string(k);
    } else {
      what = "argument " + std::to_string(i);
    }
    nb::object v;
    const auto tag = r.get<uint8_t>();
    switch (tag) {
      case kTagNone:
        v = nb::none();
        break;
      case kTagFalse:
      case kTagTrue:
        v = nb::bool_(tag == kTagTrue);
        break;
      case kTagInt:
        v = nb::int_(r.get<int64_t>());
        break;
      case kTagFloat:
        v = nb::float_(r.get<double>());
        break;
      case kTagStr:
      case kTagJson: {
        const auto len = r.get<uint32_t>();
        const std::string_view s = r.bytes(len);
        v = utf8(s, what);
        if (tag == kTagJson) {
          try {
            v = py().json_loads(v);
          } catch (nb::python_error& e) {
            malformed(what + ": " + python_message(e));
          }
        }
        break;
      }
      case kTagArray:
        v = array_view(read_array(r, size, what), input);
        break;
      case kTagBytes: {
        const auto off = r.get<uint64_t>();
        const auto len = r.get<uint64_t>();
        if (off > size || len > size - off) {
          malformed(what + ": the bytes [" + std::to_string(off) + ", +" + std::to_string(len) +
                    ") lie outside the job's " + std::to_string(size) + "-byte input");
        }
        if (buffers_as_views) {
          v = nb::steal(PySequence_GetSlice(input.ptr(), static_cast<Py_ssize_t>(off),
                                            static_cast<Py_ssize_t>(off + len)));
        } else {
          v = nb::steal(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(base + off),
                                                  static_cast<Py_ssize_t>(len)));
        }
        if (!v.is_valid()) throw nb::python_error();
        break;
      }
      default:
        malformed(what + ": unknown entry tag " + std::to_string(tag));
    }
    if (i < positional) {
      PyList_SET_ITEM(args.ptr(), static_cast<Py_ssize_t>(i), v.release().ptr());
    } else {
      kwargs[key] = v;
    }
  }
  return nb::make_tuple(flags, args, kwargs);
}

int64_t write_answer(nb::handle out, Kind kind, nb::handle arrays, std::string_view extra) {
  HeldBuffer o;
  if (!o.get(out.ptr(), PyBUF_WRITABLE)) throw nb::python_error();
  auto* p = static_cast<std::byte*>(o.view.buf);
  const auto capacity = static_cast<uint64_t>(o.view.len);
  std::vector<OutArray> items(arrays.is_none() ? 0 : nb::len(arrays));
  uint64_t header = kAnswerFixed + extra.size();
  size_t i = 0;
  if (!arrays.is_none()) {
    for (nb::handle a : arrays) {
      take_array(items[i], a);
      header += items[i].entry_bytes();
      ++i;
    }
  }
  std::vector<uint64_t> offsets(items.size());
  uint64_t end = header;
  uint64_t at = align(header);
  for (size_t j = 0; j < items.size(); ++j) {
    offsets[j] = at;
    end = at + items[j].nbytes();
    at = align(end);
  }
  if (end > capacity || header > UINT32_MAX) return -static_cast<int64_t>(end);
  Writer w(p);
  w.bytes(std::string_view(kAnswerMagic.data(), kAnswerMagic.size()));
  w.put<uint32_t>(static_cast<uint32_t>(header));
  w.put<uint32_t>(static_cast<uint32_t>(kind));
  w.put<uint32_t>(static_cast<uint32_t>(items.size()));
  w.put<uint32_t>(static_cast<uint32_t>(extra.size()));
  w.bytes(extra);
  for (size_t j = 0; j < items.size(); ++j) items[j].write_entry(w, offsets[j]);
  auto copy = [&] {
    for (size_t j = 0; j < items.size(); ++j) {
      if (items[j].nbytes() > 0)
        std::memcpy(p + offsets[j], items[j].buffer.view.buf, items[j].nbytes());
    }
  };
  if (end >= kReleaseGilBytes) {
    nb::gil_scoped_release unlocked;
    copy();
  } else {
    copy();
  }
  return static_cast<int64_t>(end);
}

std::optional<int64_t> write_result(nb::handle out, nb::handle result) {
  PyObject* o = result.ptr();
  const auto* ndarray = reinterpret_cast<PyTypeObject*>(py().ndarray.ptr());
  auto plain = [&](PyObject* x) {
    return Py_TYPE(x) == ndarray || x == Py_True || x == Py_False || PyLong_CheckExact(x) ||
           PyFloat_CheckExact(x) || is_instance(x, py().generic);
  };
  if (o == Py_None) return write_answer(out, Kind::kNone, nb::none(), {});
  if (Py_TYPE(o) == ndarray) {
    nb::object one = nb::make_tuple(result);
    return write_answer(out, Kind::kArray, one, {});
  }
  if (plain(o)) {
    nb::object one = nb::make_tuple(py().asarray(result));
    return write_answer(out, Kind::kScalar, one, {});
  }
  if (PyTuple_CheckExact(o) || PyList_CheckExact(o)) {
    nb::list items;
    for (nb::handle x : result) {
      if (!plain(x.ptr())) return std::nullopt;
      items.append(Py_TYPE(x.ptr()) == ndarray ? nb::borrow(x) : py().asarray(x));
    }
    return write_answer(out, Kind::kTuple, items, {});
  }
  return std::nullopt;
}

}  // namespace gpuq::python::codec
