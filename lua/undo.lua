-- Undoes spends that an all-or-nothing check made on one client's buckets
-- when a rule of another client (another slot) refused the same request.
-- KEYS the buckets; ARGV four per bucket: algorithm, capacity, rate or
-- window (µs), amount. Each gives back at most what was taken:
--   token_bucket, gcra: the state moves back by amount / rate (rounded
--     down), never before now;
--   sliding_window, fixed_window: the count of the window spent in goes
--     down by amount, never below 0;
--   sliding_log: the newest amount entries go.
local now = now_us()

local function undo_instant(key, rate, amount)
  local t = tonumber(read_string(key) or 0) or 0
  if t <= now then return end
  t = t - math.floor(amount * 1e6 / rate)
  if t <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, fmt_int(t), 'PX', fmt_int(math.ceil((t - now) / 1000)))
  end
end

local undos = {
  token_bucket = function(key, cap, rate, amount) undo_instant(key, rate, amount) end,
  gcra = function(key, cap, rate, amount) undo_instant(key, rate, amount) end,
  sliding_window = function(key, cap, w, amount)
    local idx = window_index(now, w)
    local cur, prev = sliding_window_read(key, idx)
    local v = read_string(key)
    if not v then return end
    local stored = tonumber(string.match(v, '^(%d+) '))
    if stored == idx then
      sliding_window_write(key, idx, w, math.max(cur - amount, 0), prev, now)
    elseif stored == idx - 1 then
      -- Spent in the window that has just become the previous one.
      sliding_window_write(key, idx, w, 0, math.max(prev - amount, 0), now)
    end
  end,
  fixed_window = function(key, cap, w, amount)
    local idx = window_index(now, w)
    local count, fresh = fixed_window_read(key, idx)
    if not fresh then
      fixed_window_write(key, idx, w, math.max(count - amount, 0), false)
    end
  end,
  sliding_log = function(key, cap, w, amount)
    redis.pcall('ZPOPMAX', key, math.floor(amount + 0.5))
  end,
}

for i = 1, #KEYS do
  local j = (i - 1) * 4
  local undo = undos[ARGV[j + 1]]
  if undo then
    undo(KEYS[i], tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4]))
  end
end
return 1
